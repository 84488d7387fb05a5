"""Conversation data: sources (hub, local files, self-generated), chat template + loss masks, on-disk store.

Later stages use prepare_data (build or reuse runs/<name>/data/), load_samples and load_token_freq.
"""

from specctl.data.chat import pre_query_prefix, render, tokenize_conversation, tokenize_conversations
from specctl.data.prepare import OWNER as DATA_OWNER
from specctl.data.prepare import DataSummary, data_fingerprint, load_samples, load_token_freq, prepare_data

__all__ = [
    "DATA_OWNER",
    "DataSummary",
    "data_fingerprint",
    "load_samples",
    "load_token_freq",
    "pre_query_prefix",
    "prepare_data",
    "render",
    "tokenize_conversation",
    "tokenize_conversations",
]
