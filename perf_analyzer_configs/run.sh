#!/usr/bin/env bash
# One perf_analyzer command per model, with its input data from this folder:
#   perf_analyzer_configs/run.sh MODEL [perf_analyzer flags; default --concurrency-range 2 --request-count 16]
# MODEL: omni_chat, omni_speech (entry points), preprocess, llm, postprocess, speech_options, tts,
#        vision_encoder, audio_encoder (zero inputs of the default encoders' shapes; dynamic batching),
#        omni_chat_mm (text-only omni_chat data), media_embed (one zero image), voice (a voice check; a model with
#        a talker: its spoken answers are measured through omni_speech).
# Decoupled models need gRPC streaming; the others use plain gRPC.
# Server: OMNI_GRPC_URL (default localhost:8001, what scripts/serve.sh listens on).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
model="${1:?usage: run.sh MODEL [perf_analyzer flags]}"
shift
case "$model" in
  omni_chat|omni_chat_mm|omni_speech|llm|tts|voice) mode=(--async --streaming) ;;   # decoupled
  preprocess|postprocess|speech_options|vision_encoder|audio_encoder|media_embed) mode=() ;;
  diffusion|png_encode|text2image) mode=() ;;   # text to image (one response each)
  *) echo "run.sh: unknown model $model" >&2; exit 2 ;;
esac
data="$HERE/$model.json"
[[ "$model" == preprocess ]] && data="$HERE/omni_chat.json"   # preprocess takes omni_chat's inputs
# perf_analyzer rejects --request-count with a concurrency range, so the defaults apply only without flags.
(( $# )) || set -- --concurrency-range 2 --request-count 16
exec bash "$HERE/../scripts/perf_analyzer.sh" -m "$model" -i grpc -u "${OMNI_GRPC_URL:-localhost:8001}" \
  "${mode[@]}" --input-data "$data" "$@"
