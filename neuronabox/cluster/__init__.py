"""The emulation cluster (nbox up): state, namespaces, shaping, agent, stubs, compose."""
