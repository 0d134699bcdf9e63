import pytest
import torch

import configs
from model import Transformer


@pytest.fixture(scope="session")
def micro_model():
    torch.manual_seed(0)
    cfg = configs.load("micro", ["model.index_topk=8", "model.initializer_range=0.1"]).model
    return Transformer(cfg).eval()


@pytest.fixture(scope="session")
def mtp_model():
    """micro trained briefly with the MTP loss on the generated corpus, so MTP drafts are mostly right."""
    from model import ByteTokenizer
    from trainers.data import generated_corpus, lm_batches
    from trainers.lm import train_lm

    cfg = configs.load("micro", ["train.mtp_loss_weight=1.0", "train.max_seconds=1800", "model.mtp_draft_steps=2"])
    torch.manual_seed(0)
    m = Transformer(cfg.model)
    tok = ByteTokenizer()
    ids = tok.encode(generated_corpus(600))
    train_lm(m, lm_batches(ids, 64, 16), cfg.train, steps=250)
    m.eval()
    prompts = [tok.encode(line[:30]) for line in generated_corpus(4, seed=5).splitlines()]
    return m, prompts
