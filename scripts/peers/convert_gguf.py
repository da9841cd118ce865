"""llama.cpp's convert_hf_to_gguf.py on a checkpoint whose BPE pre-tokenizer it does not know.

The converter names a GGUF's pre-tokenizer by a hash of its tokens on a fixed text and refuses unknown hashes. The
benchmark's decoder has a small BPE of its own behind Qwen2's split regex, so an unknown hash is mapped to ``qwen2``
(the token counts then equal the Hugging Face tokenizer's). Usage:
    python convert_gguf.py LLAMA_CPP_SRC MODEL_DIR OUTFILE OUTTYPE
"""
import sys
from pathlib import Path

src, model, outfile, outtype = sys.argv[1:5]
sys.path.insert(0, src)
sys.path.insert(1, str(Path(src) / "gguf-py"))
import conversion.base as base  # noqa: E402  (the converter's own package, from its tree)

_known = base.TextModel.get_vocab_base_pre


def _vocab_base_pre(self, tokenizer) -> str:
    try:
        return _known(self, tokenizer)
    except NotImplementedError:
        return "qwen2"


base.TextModel.get_vocab_base_pre = _vocab_base_pre
import convert_hf_to_gguf  # noqa: E402

sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", outfile, "--outtype", outtype]
convert_hf_to_gguf.main()
