"""The embedded inference engine: an OpenAI-compatible, vLLM-shaped server over a Hugging Face causal LM, for
CPUs, tests and the demo (what vLLM is on GPUs), and everything only it uses.

- :mod:`.server` — :class:`~aglverl.engine.server.InferenceServer`: the HTTP app, its routes and life cycle,
  sleep / wake-up, weight swaps, aborts, in-process generation; :class:`~aglverl.engine.server.InferenceStats`;
- :mod:`.thread` — :class:`~aglverl.engine.thread.InferenceServerThread`, the server on a thread of its own;
- :mod:`.requests` — the request models, their validation errors, and the plan a request becomes (context,
  tools, prompt ids given in ``kv_transfer_params.prompt_token_ids``: the one-request token-in path);
- :mod:`.job` — one request in flight: its choices, their text, stop strings, streamed deltas;
- :mod:`.answers` — answer bodies and stream chunks for chat, completions and generate, in vLLM's shapes;
- :mod:`.scale_out` — the handlers of vLLM's scale-out routes (render / generate from ids / derender), whose
  wire models are :mod:`.token_routes`;
- :mod:`.generation` — the continuous-batching generation engine on its own thread;
- :mod:`.chat_template` (chat requests to prompt ids), :mod:`.chat_parser` (generated text to an assistant
  message: tool calls, reasoning), :mod:`.constrained` (constrained decoding for forced tool calls),
  :mod:`.tokens` (token ids and text through the tokenizer);
- :mod:`.tiny` — the default model, built locally and deterministically, never downloaded.

Importing this package loads nothing heavy; its modules import torch and transformers.
"""
