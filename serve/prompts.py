"""Requests → prompt token ids and generation parameters (context, sampling and model checks).

Kept apart from the HTTP layer so the rules (what is a 400, what the defaults are) read in one place.
"""

from __future__ import annotations

from typing import Any

from .engine import GenerationParams, SamplingParams
from .protocol import APIError, ChatCompletionRequest, CompletionRequest


def chat_prompt_ids(tokenizer: Any, request: ChatCompletionRequest) -> list[int]:
    """The tokenizer's own chat template with the generation prompt (as `mtp generate` applies it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    try:
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
    except Exception as e:  # jinja templates raise on roles/orders they do not accept
        raise APIError(400, f"messages do not fit the model's chat template: {e}", param="messages") from None
    return [int(t) for t in encoded["input_ids"][0].tolist()]


def completion_prompt_ids(tokenizer: Any, request: CompletionRequest, vocab_size: int) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
        return list(prompt)
    text = prompt[0] if isinstance(prompt, list) else prompt
    ids = tokenizer(text).input_ids
    if not ids:
        raise APIError(400, "prompt is empty after tokenization", param="prompt")
    return [int(t) for t in ids]


def generation_params(
    request: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    max_context: int,
    supports_sampling: bool,
    default_speculative: bool = True,
) -> GenerationParams:
    """Resolve max_tokens against the context and decide greedy vs sampled decoding.

    Default temperature is 0 (greedy): the exact, reproducible path this server exists for. OpenAI's
    default is 1; clients that want sampling send `temperature` explicitly.
    """
    prompt_len = len(prompt_ids)
    room = max_context - prompt_len
    if room <= 0:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion. Please shorten the prompt.",
            param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    limit = request.completion_limit()
    if limit is not None and limit > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_len + limit} tokens ({prompt_len} in the prompt, {limit} for the completion). "
            "Please reduce the prompt or the completion length.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    sampling = None
    if request.temperature is not None and request.temperature > 0:
        if not supports_sampling:
            raise APIError(
                400,
                "sampling (temperature > 0) is not available in this build: the decoder is greedy-only. "
                "Send temperature 0 (or omit it).",
                param="temperature",
                code="sampling_unsupported",
            )
        # OpenAI semantics: an absent top_p/top_k means no filtering (not the model's generation_config).
        top_k = request.top_k if request.top_k not in (None, -1) else 0
        top_p = request.top_p if request.top_p is not None else 1.0
        sampling = SamplingParams(temperature=request.temperature, top_p=top_p, top_k=top_k, seed=request.seed)
    return GenerationParams(
        prompt_ids=prompt_ids,
        max_tokens=limit if limit is not None else room,
        stop=request.stop_list(),
        speculative=default_speculative if request.speculative is None else request.speculative,
        sampling=sampling,
    )


def context_length(model: Any, override: int | None = None) -> int:
    """`--max-context`, else the base config's position table (`max_position_embeddings`/`n_positions`)."""
    if override is not None:
        return override
    config = model.base_model.config
    get_text = getattr(config, "get_text_config", None)
    config = get_text() if callable(get_text) else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError("the model's config gives no context length; pass --max-context")
