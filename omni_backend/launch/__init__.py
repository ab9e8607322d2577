"""Launchers, named by what they start:

- `launch.tritonserver.TritonServer`: one tritonserver process on a model repository (tests and scripts use it);
- `launch.front_door.FrontDoorProcess`: one OpenAI front door process (`python -m omni_backend.serving`);
- `python -m omni_backend.launch` (what `scripts/serve.sh` runs): both, tritonserver first, until Ctrl-C/SIGTERM.

The front door itself, in-process, is `omni_backend.serving` (`create_app`).
"""
