"""The parent side of ``nbox run``: plan, environment, elastic agent, runner, role profiling, and the child's start-up.

``runner`` starts the user's command as the real ranks (one child, or torch's elastic agent
through ``elastic``) with the environment the emulator reads (``neuronabox.emu.environ``,
``prepare_env``) and ``autostart/sitecustomize.py`` first on its
PYTHONPATH, then reads the records the children write (``child``). ``profiling`` runs the
command once per role to record a role profile. The in-process emulator itself is
``neuronabox.emu``; the launcher imports it, never the other way round.
"""
