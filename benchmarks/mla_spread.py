"""How far a bf16 decode step of GLM-5 over the latent cache is from transformers' forward without a cache, beside
transformers' own cached step: the spread the MLA correctness target is judged against.

    PYTHONPATH=src python benchmarks/mla_spread.py --out DIR [--context 2048,8192] [--layers 4]
    PYTHONPATH=src python benchmarks/mla_spread.py --tiny        # a small config on any device

Two sequences of ``context`` random tokens: transformers' forward without a cache on the whole sequence (the
reference), transformers' step after prefilling its DynamicCache in chunks, and piecewise's step after prefilling
the latent cache through slots; rel. error of each step's last-token logits against the reference, and between the
two steps. Where the indexer picks fewer keys than the context holds, bf16 rounding may pick other near-tied keys in
either cached step. Writes mla_spread.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import piecewise  # noqa: E402
from hf_decode import GLM5, GLM5_TINY, build, rel_error  # noqa: E402
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--context", default="2048,8192")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    from transformers import DynamicCache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    contexts = [40] if args.tiny else [int(c) for c in args.context.split(",")]
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "command": "PYTHONPATH=src python benchmarks/mla_spread.py " + " ".join(sys.argv[1:]), "rows": {}}
    with torch.no_grad():
        model = build(GLM5_TINY if args.tiny else GLM5, args.layers, device, dtype, "GlmMoeDsa")
        own = model.config._attn_implementation, model.config._experts_implementation
        for context in contexts:
            model.config._attn_implementation, model.config._experts_implementation = own
            torch.manual_seed(context)
            ids = torch.randint(0, model.config.vocab_size, (2, context + 1), device=device)
            reference = torch.cat([model(input_ids=ids[s : s + 1], use_cache=False, logits_to_keep=1).logits[:, -1]
                                   for s in range(2)])
            cache = DynamicCache(config=model.config)
            for start in range(0, context, 256):
                model(input_ids=ids[:, start : min(start + 256, context)], past_key_values=cache, use_cache=True)
            theirs = model(input_ids=ids[:, context:], past_key_values=cache, use_cache=True).logits[:, -1]
            del cache
            token_model = TokenModel(enable(model))
            latent = token_model.make_kv_cache(max_seq_len=context + 1, sequences=2)
            runner = piecewise.compile(token_model, piecewise.CaptureConfig(max_tokens=2))
            for s in range(2):
                runner(ids[s, :context], torch.arange(context, device=device), latent,
                       torch.full((context,), s, device=device))
            ours = runner(ids[:, context], torch.full((2,), context, device=device), latent,
                          torch.arange(2, device=device))
            result["rows"][context] = {"transformers_cached_step": rel_error(theirs, reference),
                                       "piecewise_step": rel_error(ours, reference),
                                       "piecewise_vs_transformers_step": rel_error(ours, theirs)}
            print(context, result["rows"][context], flush=True)
            del runner, latent, token_model
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mla_spread.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
