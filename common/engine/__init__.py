"""The engine: one process's model, KV cache and scheduler, stepped by its owner.

    config.py, request.py, sampling_params.py   what it is asked to do (every default declared once)
    scheduler.py (+ scheduler_turns, room_alone, scheduler_integrity)   a token budget per step
    model_runner.py, sampler.py, inverse_cdf.py  one packed forward per step, then sampling
    penalty_histories.py                          penalised requests' token ids, kept across steps
    engine.py          add_request / step / abort; generate on top
    kv/                KV memory: blocks, prefix hashes, the cache tensors
    attention/         paged attention: interface, selection, one file per backend
    models/            the decoder (Llama family, Gemma 3)
    loading/           checkpoints: Hugging Face, GGUF, the default model, the Hub
"""
