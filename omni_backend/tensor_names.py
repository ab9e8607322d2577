"""Every Triton tensor name that crosses a process: the inputs and outputs of the models in `model_repository/`.

The model configs (`config.pbtxt`) declare them for Triton; everything in Python names them through these constants,
so a renamed tensor is one edit here plus the configs (tests/test_structure.py checks both agree and that no other
module spells one out). The sampling settings' tensors (`max_tokens`, `random_seed`, ...) are
`vocabulary.SAMPLING_FIELDS`'. Names shared with TensorRT-LLM's backend (`text_input`, `text_output`,
`stop_words`, ...) are kept as they are there: genai-perf and Triton's own OpenAI frontend send them.
"""

# The prompt: inputs of the chat entry points (omni_chat, omni_chat_mm, omni_speech) and of preprocess.
TEXT_INPUT = "text_input"  # BYTES [1]: a plain prompt, or a JSON array of chat messages
PROMPT_TOKEN_IDS = "prompt_token_ids"  # INT32 [n]: a prompt given as token ids
PROMPT_IS_TEXT = "prompt_is_text"  # BOOL [1]: text_input is a plain prompt even when it starts with '['
ADD_GENERATION_PROMPT = "add_generation_prompt"  # BOOL [1]: the chat template opens the assistant's turn
CONTINUE_FINAL_MESSAGE = "continue_final_message"  # BOOL [1]: the prompt ends inside the last assistant message
TOOLS = "tools"  # BYTES [1]: a JSON array of OpenAI tool definitions shown to the model (preprocess)
# structured output, as TensorRT-LLM's backend names them (vocabulary.SAMPLING_FIELDS' guide_type and guide)
GUIDED_DECODING_GUIDE_TYPE = "guided_decoding_guide_type"  # BYTES [1]: json, json_schema, regex, ebnf_grammar or structural_tag
GUIDED_DECODING_GUIDE = "guided_decoding_guide"  # BYTES [1]: the schema, regex, grammar or structural tag

# preprocess -> llm
INPUT_IDS = "input_ids"  # INT32 [n]
SAMPLING_PARAMS = "sampling_params"  # BYTES [1]: SamplingParams as JSON
PROMPT_TEXT = "prompt_text"  # BYTES [1]: the rendered prompt (echo, logprobs)

# media: preprocess -> media_embed -> the encoders -> llm
PIXEL_VALUES = "pixel_values"  # FP32 [items, ...]: [3, H, W] pixels, or an item of patch rows (Qwen2.5-Omni)
INPUT_FEATURES = "input_features"  # FP32 [items, mel bins, frames]
INPUT_LENGTHS = "input_lengths"  # INT32 [items]: valid frames of each audio item
MEDIA_PARTS = "media_parts"  # BYTES [1]: JSON list of the message's media parts
MEDIA_POSITIONS = "media_positions"  # INT32 [n]: prompt positions of the placeholders
EMBEDDINGS = "embeddings"  # FP32 [items, tokens, hidden]: an encoder's output
PROMPT_EMBEDS = "prompt_embeds"  # FP32 [k, hidden]: rows replacing token embeddings
PROMPT_EMBED_POSITIONS = "prompt_embed_positions"  # INT32 [k]: the prompt positions they replace
PROMPT_POSITIONS = "prompt_positions"  # INT32 [3, n]: M-RoPE (t, h, w) ids of the prompt's tokens ([3, 0]: none)

# llm (decoupled): its other inputs and its outputs, which postprocess and tts pass on
RESET_PREFIX_CACHE = "reset_prefix_cache"  # BOOL [1]: the operator's reset request
STREAM_KEY = "stream_key"  # BYTES [1]: names a generation so that a later request can cancel it
CANCEL = "cancel"  # BYTES [1]: a request of its own: ends the generation whose stream_key this is
DROPPED_BLOCKS = "dropped_blocks"  # INT32 [1]: the answer to a reset
TEXT_OUTPUT = "text_output"  # BYTES [1]: a text delta (the whole text when not streaming)
OUTPUT_IDS = "output_ids"  # INT32 [n]
FINISH_REASON = "finish_reason"  # BYTES [1]: "" while running, then stop, length or abort
PROMPT_TOKENS = "prompt_tokens"  # INT32 [1]
COMPLETION_TOKENS = "completion_tokens"  # INT32 [1]
CACHED_TOKENS = "cached_tokens"  # INT32 [1]: prompt tokens the prefix cache supplied
OUTPUT_LOGPROBS = "output_logprobs"  # BYTES [1]: JSON of the delta's token logprobs ("" when not asked)
PROMPT_TOKEN_LOGPROBS = "prompt_token_logprobs"  # BYTES [1]: JSON of the prompt's logprobs ("" when not asked)
HIDDEN_STATES = "hidden_states"  # FP32 [k, H]: last-layer hidden states of the response's new rows (asked for)
INPUT_EMBEDS = "input_embeds"  # FP32 [k, H]: their layer-0 input embeddings

# Qwen2.5-Omni's own voice: llm rows -> voice (talker + code2wav), keyed by stream_key (stages/voice.py)
WAVEFORM = "waveform"  # FP32 [n]: float samples in [-1, 1] at sample_rate

# speech: speech_options -> tts (omni_speech)
VOICE = "voice"  # BYTES [1]
AUDIO_FORMAT = "audio_format"  # BYTES [1]
SPEED = "speed"  # FP32 [1]
OPTIONS = "options"  # BYTES [1]: tts's name for speech_options
TEXT = "text"  # BYTES [1]: tts's text delta
AUDIO = "audio"  # BYTES [1]: an encoded audio chunk
SAMPLE_RATE = "sample_rate"  # INT32 [1], Hz
CHUNK_INDEX = "chunk_index"  # INT32 [1]: the chunk's place in its stream

# images: text2image = diffusion -> png_encode
PROMPT = "prompt"  # BYTES [1]
NEGATIVE_PROMPT = "negative_prompt"  # BYTES [1]
HEIGHT = "height"  # INT32 [1], pixels
WIDTH = "width"  # INT32 [1], pixels
STEPS = "steps"  # INT32 [1]
GUIDANCE_SCALE = "guidance_scale"  # FP32 [1]
SEED = "seed"  # INT64 [1]: the seed asked for (diffusion), the one used (its output)
USED_SEED = "used_seed"  # INT64 [1]: text2image's name for the seed diffusion used
IMAGE = "image"  # UINT8 [1, H, W, 3]
PNG = "png"  # BYTES [1]: PNG file bytes
