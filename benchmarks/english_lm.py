"""Pretrain the English language model that the package ships (`austen-gpt2`): the BPE tokenizer and the GPT-2 of
`EnglishLMRecipe` on Jane Austen's six novels from Debian's r-cran-janeaustenr, then its surprisal profile on the held-out
paragraphs, written with the model (`save_english_lm`).

    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_1.0.0-1_all.deb corpus/
    python benchmarks/english_lm.py --corpus corpus/ --out /tmp/austen-gpt2
    python benchmarks/english_lm.py --corpus corpus/ --out /tmp/again --compare austen-gpt2

`--ship NAME` adds the written directory to the package's catalogue of language models. `--compare NAME` prints the held-out
perplexity of a shipped model beside the one just trained (a model pretrained again on another CPU is another model: its
perplexity, not its weights, is what can agree). Figures are printed and written, never asserted.
"""
import argparse
import json
import time
from pathlib import Path

import torch

from basedirected.english import AUSTEN_PACKAGE, EnglishLMRecipe, austen_novels, pretrain_english_lm, prose_profile, save_english_lm, split_prose, token_stream
from basedirected.machine import cpu_model, environment_record
from basedirected.pretrained import add_lm_to_catalogue, backbone_directory


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="the unpacked r-cran-janeaustenr package (dpkg-deb -x), or its data/Rdata.rdb")
    p.add_argument("--out", required=True, help="the directory to write the model to (new)")
    p.add_argument("--name", default="austen-gpt2", help="the model's name in its record")
    p.add_argument("--steps", type=int, default=EnglishLMRecipe.steps, help="optimizer steps (the recipe's by default)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--ship", default=None, help="add the written model to the package's catalogue under this name")
    p.add_argument("--compare", default=None, help="a shipped model whose held-out perplexity to print beside this one's")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    recipe = EnglishLMRecipe(steps=a.steps)
    novels = austen_novels(a.corpus)
    train, heldout = split_prose(novels, recipe.heldout_fraction)
    print(f"corpus: {sum(len(v) for v in novels.values())} paragraphs; {len(train)} to train on, {len(heldout)} held out", flush=True)
    start = time.perf_counter()
    model, tokenizer, losses = pretrain_english_lm(train, recipe, log=lambda s, l, t: print(f"step {s}: loss {l:.3f} ({t:.0f} s)", flush=True))
    seconds = time.perf_counter() - start
    profile = prose_profile(model, tokenizer, heldout)
    env = environment_record(recipe.seed)
    record = {"name": a.name, "parameters": sum(q.numel() for q in model.parameters()), "recipe": recipe.__dict__ | {"steps": a.steps},
              "corpus": {**AUSTEN_PACKAGE, "train_paragraphs": len(train), "heldout_paragraphs": len(heldout),
                         "train_tokens": len(token_stream(tokenizer, train))},
              "seconds": round(seconds, 1), "final_loss": sum(losses[-50:]) / len(losses[-50:]), "heldout": profile,
              "made": {"revision": (env["git_revision"] or "unknown")[:7] + ("+dirty" if env["git_dirty"] else ""), "cpu": cpu_model(),
                       "threads": a.threads, "torch": torch.__version__}}
    out = save_english_lm(model, tokenizer, heldout, record, a.out)
    print(json.dumps({"seconds": record["seconds"], "final_loss": round(record["final_loss"], 4), **profile}, indent=1))
    if a.compare:
        shipped = Path(backbone_directory(a.compare))
        ref = json.loads((shipped / "english_lm.json").read_text())["heldout"]["perplexity"]
        print(f"held-out perplexity: {profile['perplexity']:.3f} here, {ref:.3f} recorded for {a.compare} "
              f"(ratio {profile['perplexity'] / ref:.4f})")
    if a.ship:
        add_lm_to_catalogue(out, a.ship, f"a GPT-2 of {record['parameters'] / 1e6:.2f} M parameters pretrained on Jane Austen's six novels "
                                         f"(held-out perplexity {profile['perplexity']:.1f}); --backbone {a.ship}")
        print(f"added to the catalogue as {a.ship}")


if __name__ == "__main__":
    main()
