"""The English language model shipped with the package (`austen-gpt2`): it loads with `from_pretrained` and by name, its files
are checked, and its record (corpus, licence, held-out profile) agrees with what the model does and with its model card."""
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from basedirected.config import resolve_config
from basedirected.english import AUSTEN_PACKAGE, HELDOUT_FILE, LM_RECORD, EnglishLMRecipe, austen_novels, model_card, prose_profile, split_prose
from basedirected.presets import PRESETS, with_backbone
from basedirected.pretrained import backbone_directory, shipped_lms, verify_shipped_lm

NAME = "austen-gpt2"


@pytest.fixture(scope="module")
def shipped():
    lm = shipped_lms()[NAME]
    verify_shipped_lm(lm)
    return lm, json.loads((lm.path / LM_RECORD).read_text())


def test_it_loads_with_from_pretrained_and_by_name(shipped):
    lm, record = shipped
    model = transformers.AutoModelForCausalLM.from_pretrained(lm.path, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(lm.path, local_files_only=True)
    assert isinstance(model, transformers.GPT2LMHeadModel) and sum(p.numel() for p in model.parameters()) == record["parameters"]
    assert len(tok) == record["recipe"]["vocab_size"] and model.config.n_positions == record["recipe"]["n_positions"]
    text = "Mr. Darcy’s letter — 1814."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert backbone_directory(NAME) == str(lm.path)
    config = resolve_config("sorting", backbone=NAME)
    assert config.backbone == str(lm.path)
    assert with_backbone(PRESETS["rescaling-one-seed"], NAME).backbone == str(lm.path)


def test_a_changed_file_is_refused(shipped, tmp_path):
    lm, _ = shipped
    root = tmp_path / "lms"
    shutil.copytree(lm.path.parent, root)
    weights = root / NAME / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 1]))
    with pytest.raises(ValueError, match="checksum differs"): backbone_directory(NAME, root=root)


def test_the_record_names_its_corpus_and_licence(shipped):
    _, record = shipped
    c = record["corpus"]
    assert {k: c[k] for k in AUSTEN_PACKAGE} == AUSTEN_PACKAGE and "public domain" in c["licence"] and "MIT" in c["licence"]
    assert record["recipe"] == EnglishLMRecipe(steps=record["recipe"]["steps"]).__dict__


def test_the_recorded_profile_is_the_models(shipped):
    "The held-out profile measured again on the shipped paragraphs: equal to round-off (float32 kernels differ between CPUs)."
    lm, record = shipped
    model = transformers.AutoModelForCausalLM.from_pretrained(lm.path, local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(lm.path, local_files_only=True)
    heldout = (lm.path / HELDOUT_FILE).read_text().splitlines()
    assert len(heldout) == record["corpus"]["heldout_paragraphs"]
    again = prose_profile(model, tok, heldout)
    assert again["tokens"] == record["heldout"]["tokens"]
    for k in ("perplexity", "b_mean", "b_cv", "b_top10_share"): assert math.isclose(again[k], record["heldout"][k], rel_tol=1e-4), k


def test_the_model_card_is_its_record(shipped):
    lm, record = shipped
    assert (lm.path / "README.md").read_text() == model_card(record)


@pytest.mark.skipif(not os.environ.get("AUSTEN_CORPUS"), reason="the corpus is not unpacked here (AUSTEN_CORPUS: .ci/run unpacks it)")
def test_the_heldout_paragraphs_are_the_corpus_split(shipped):
    lm, record = shipped
    train, heldout = split_prose(austen_novels(os.environ["AUSTEN_CORPUS"]), record["recipe"]["heldout_fraction"])
    assert (lm.path / HELDOUT_FILE).read_text().splitlines() == heldout and len(train) == record["corpus"]["train_paragraphs"]


def test_the_readme_quotes_the_record(shipped):
    _, record = shipped
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    p = record["heldout"]
    assert (f"a GPT-2 of {record['parameters'] / 1e6:.2f} M parameters pretrained here in {record['seconds'] / 60:.1f} minutes" in readme
            and f"held-out perplexity of {p['perplexity']:.1f} per token" in readme
            and f"a CV of $b_t$ of {p['b_cv']:.2f} and {p['b_top10_share'] * 100:.0f} % of the total on the top tenth" in readme)
    profiles = (Path(__file__).parents[1] / "reference" / "base-profiles" / "profiles.csv").read_text().splitlines()[1:]
    tasks = [float(l.split(",")[6]) for l in profiles if ",visiting_order," not in l]
    assert min(tasks) >= 0.997 and "every task base puts 99.7 % or more there" in readme
