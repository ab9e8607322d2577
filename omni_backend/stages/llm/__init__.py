"""The `llm` stage: our LLM engine behind a decoupled Triton model.

One file per job:

- `parameters.py`: the model's Triton parameters (the engine's settings, the stage's, the governor's) and the
  instance's device;
- `server_probe.py`: what the stub learns from its parent tritonserver (operator key, whether it is stopping);
- `messages.py`, `core.py`: the engine loop thread and the typed messages it takes;
- `outputs.py`: the response thread (outputs to sinks, cancellation polling);
- `stop_watch.py`: aborting held requests in time when the server stops;
- `service.py`: `LLMService`, the client side that admits requests and ties the threads together;
- `build.py`: the service from the model's parameters;
- `triton_io.py`: the model's input and output tensors.
"""
