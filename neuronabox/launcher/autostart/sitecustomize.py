"""Started by ``nbox run``: this folder is put first on the child's PYTHONPATH.

Python imports ``sitecustomize`` at start-up, so any Python process of the run (``python
train.py``, ``python -m pkg``, a wrapper script that execs Python) gets the nbox backend
installed as torch is imported, before the user's code can use torch.distributed — with no
change to the script (a Python process of the run that never imports torch pays nothing).
A ``sitecustomize`` that this one shadows is still run afterwards.
"""

import os
import sys


def _chain_shadowed_sitecustomize() -> None:
    import importlib.machinery  # not an attribute of importlib until someone imports it
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("NBOX_TOPOLOGY"):
    try:
        from neuronabox.launcher.child import autostart
        from neuronabox.launcher.elastic import apply_worker_env
    except ImportError as exc:  # another Python than the one nbox is installed in
        sys.stderr.write(f"nbox: this Python ({sys.executable}) cannot load neuronabox ({exc}); "
                         "run the command with the Python that has nbox and torch\n")
    else:
        if os.environ.get("NBOX_ELASTIC"):
            from neuronabox.launcher.guard import ENV_PARENT, die_with_parent

            if os.environ.get(ENV_PARENT) == str(os.getppid()):
                # A worker that torch's agent (inside nbox run) started itself, not a process one
                # of them started in turn: it dies with nbox run (guard.py).
                die_with_parent()
        try:
            # A worker of torch's elastic agent (nbox run --nproc-per-node/--nnodes): torchrun's
            # environment becomes the emulated world's before anything reads it.
            apply_worker_env()
        except Exception as exc:  # site.py would print a warning and run the script untranslated
            sys.stderr.write(f"{exc}\n")
            sys.stderr.flush()
            os._exit(1)  # SystemExit here is a "Fatal Python error" of site.py
        import importlib.util

        if importlib.util.find_spec("torch") is None:  # neuronabox on the path of a Python without torch
            sys.stderr.write(f"nbox: this Python ({sys.executable}) cannot load torch; "
                             "nothing is emulated in it: run the command with the Python that has nbox and torch\n")
        else:
            autostart()  # the backend is installed when the process imports torch
_chain_shadowed_sitecustomize()
