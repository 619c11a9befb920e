"""The emulated world: the nbox collective backend, its timeline, and the launcher."""
