"""The GLM-5 / DeepSeek-V3.2 model room: config, network, cache, losses, checkpoints, tokenizers."""

from .cache import KVCache
from .checkpoint import load_checkpoint, load_config, read_checkpoint_meta, save_checkpoint, weights_checksum
from .config import ModelConfig, YarnConfig
from .losses import (
    indexer_kl_loss,
    indexer_parameters,
    lm_forward_loss,
    lm_loss,
    mtp_loss,
    next_token_loss,
    rows_logprobs,
    token_logprobs,
)
from .tokenizer import ByteTokenizer, ChatTemplate, HFTokenizer
from .transformer import ModelOutput, Transformer

__all__ = [
    "weights_checksum",
    "ByteTokenizer", "ChatTemplate", "HFTokenizer", "KVCache", "ModelConfig", "ModelOutput", "Transformer",
    "YarnConfig", "indexer_kl_loss", "indexer_parameters", "lm_forward_loss", "lm_loss", "load_checkpoint", "load_config",
    "mtp_loss", "next_token_loss", "read_checkpoint_meta", "rows_logprobs", "save_checkpoint", "token_logprobs",
]
