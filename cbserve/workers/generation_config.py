"""A `transformers.GenerationConfig` read as the engine's default `SamplingParams`.

Every field that changes what `generate()` picks is either honoured (the same processors, in
transformers' order: see `SamplingParams`) or refused with a ValueError naming it; fields about
output formatting, caching or other decoding modes' details change nothing here and are left.
"""

from __future__ import annotations

from transformers import GenerationConfig

from cbserve.scheduler.request import SamplingParams

# Fields whose non-default values cbserve cannot honour, and why.
UNSUPPORTED = {
    "num_beams": "beam search is not continuous batching",
    "num_beam_groups": "beam search is not continuous batching",
    "penalty_alpha": "contrastive search needs a look-ahead forward per step",
    "guidance_scale": "classifier-free guidance needs a second, unconditional forward",
    "typical_p": "typical sampling is not implemented",
    "epsilon_cutoff": "epsilon sampling is not implemented",
    "eta_cutoff": "eta sampling is not implemented",
    "top_h": "top-h sampling is not implemented",
    "force_words_ids": "constrained beam search is not continuous batching",
    "constraints": "constrained beam search is not continuous batching",
    "forced_bos_token_id": "forcing tokens is not implemented (encoder-decoder models)",
    "forced_eos_token_id": "forcing tokens is not implemented",
    "exponential_decay_length_penalty": "not implemented",
    "stop_strings": "stop strings need the tokenizer: the serving layer matches them (OpenAI `stop`)",
    "num_return_sequences": "submit the prompt n times: prefix caching shares its prefill",
    "encoder_repetition_penalty": "encoder-decoder models are not supported",
    "encoder_no_repeat_ngram_size": "encoder-decoder models are not supported",
    "watermarking_config": "watermarking is not implemented",
    "prompt_lookup_num_tokens": "speculative decoding is not implemented",
    "assistant_early_exit": "speculative decoding is not implemented",
    "max_time": "a time limit per request is not implemented",
}


# Values of those fields that change nothing (what older configs spell out instead of None).
NEUTRAL = {"num_beams": 1, "num_beam_groups": 1, "guidance_scale": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
           "eta_cutoff": 0.0, "num_return_sequences": 1, "encoder_repetition_penalty": 1.0,
           "encoder_no_repeat_ngram_size": 0, "penalty_alpha": 0.0}


def refuse_unsupported(gc: GenerationConfig) -> None:
    for name, why in UNSUPPORTED.items():
        value = getattr(gc, name, None)
        if value is not None and value != NEUTRAL.get(name) and value != [] and value != {}:
            raise ValueError(f"GenerationConfig.{name}={value!r} is not supported by cbserve: {why}")


def _token_tuples(value) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(t) for t in seq) for seq in value or ())


def _sequence_bias(value) -> tuple[tuple[tuple[int, ...], float], ...]:
    if not value:
        return ()
    items = value.items() if isinstance(value, dict) else ((tuple(s), b) for s, b in value)
    return tuple((tuple(int(t) for t in seq), float(bias)) for seq, bias in items)


def sampling_params(gc: GenerationConfig) -> SamplingParams:
    """The defaults `gc` gives every request (each may override some)."""
    refuse_unsupported(gc)
    return SamplingParams(
        do_sample=bool(gc.do_sample),
        temperature=gc.temperature if gc.temperature is not None else 1.0,
        top_k=gc.top_k or 0,
        top_p=gc.top_p if gc.top_p is not None else 1.0,
        min_p=gc.min_p or 0.0,
        repetition_penalty=gc.repetition_penalty if gc.repetition_penalty is not None else 1.0,
        min_new_tokens=gc.min_new_tokens or 0,
        no_repeat_ngram_size=gc.no_repeat_ngram_size or 0,
        bad_words_ids=_token_tuples(gc.bad_words_ids),
        sequence_bias=_sequence_bias(gc.sequence_bias),
        suppress_tokens=tuple(gc.suppress_tokens or ()),
        begin_suppress_tokens=tuple(gc.begin_suppress_tokens or ()),
        remove_invalid_values=bool(gc.remove_invalid_values),
    )
