import contextlib

import pytest
import torch

import configs
from model import Transformer


@pytest.fixture(scope="session")
def micro_model():
    torch.manual_seed(0)
    cfg = configs.load("micro", ["model.index_topk=8", "model.initializer_range=0.1"]).model
    return Transformer(cfg).eval()


@contextlib.contextmanager
def _micro_server(micro_model, max_queue: int):
    from rollout.engine import Engine
    from rollout.server import ServerThread, create_app

    m = Transformer(micro_model.config)
    m.load_state_dict(micro_model.state_dict())
    eng = Engine(m, n_slots=4, max_len=128, max_queue=max_queue)
    try:
        with ServerThread(create_app(eng, model_path="micro")) as srv:
            yield srv, eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="session")
def micro_server(micro_model):
    """`micro_server(max_queue)`: a context manager serving a copy of `micro_model` on 127.0.0.1 (4 slots,
    128 tokens) that yields (server, engine) and stops both on exit."""
    return lambda max_queue: _micro_server(micro_model, max_queue)


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
