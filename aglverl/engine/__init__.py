"""The embedded inference engine: an OpenAI-compatible, vLLM-shaped server over a Hugging Face causal LM, for
CPUs, tests and the demo (what vLLM is on GPUs), and everything only it uses.

- :mod:`.server` — :class:`~aglverl.engine.server.InferenceServer` (chat, completions, vLLM's token-in routes,
  sleep / wake-up, weight swaps, aborts) and :class:`~aglverl.engine.server.InferenceServerThread`;
- :mod:`.generation` — the continuous-batching generation engine on its own thread;
- :mod:`.chat_template` (chat requests to prompt ids), :mod:`.chat_parser` (generated text to an assistant
  message: tool calls, reasoning), :mod:`.constrained` (constrained decoding for forced tool calls),
  :mod:`.token_routes` (the wire models of vLLM's render / generate / derender routes);
- :mod:`.tiny` — the default model, built locally and deterministically, never downloaded.

Importing this package loads nothing heavy; its modules import torch and transformers.
"""
