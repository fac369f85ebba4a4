import pytest

import fairseq_moe

# What fairseq does when it loads the plugin (--user-dir): whatever test module imported fairseq_moe first.
fairseq_moe.load_plugin()

from tests.fairseq_moe.helpers import binarise_toy_corpus, binarise_toy_lm_corpus, binarise_toy_multilingual_corpus


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    return binarise_toy_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def ml_data_bin(tmp_path_factory):
    return binarise_toy_multilingual_corpus(tmp_path_factory.mktemp("ml_corpus"))


@pytest.fixture(scope="session")
def lm_data_bin(tmp_path_factory):
    return binarise_toy_lm_corpus(tmp_path_factory.mktemp("lm_corpus"))


@pytest.fixture(scope="session")
def trained_checkpoint(data_bin, tmp_path_factory):
    """checkpoint_last.pt of 2 updates of moe_transformer_tiny (4 experts) on the toy corpus, one process.
    Read-only: copy it before changing anything."""
    from tests.fairseq_moe.helpers import run_train, train_argv

    save = tmp_path_factory.mktemp("trained")
    run_train(train_argv(data_bin, save, "--max-update", "2", "--moe-expert-count", "4",
                         "--required-batch-size-multiple", "1"))
    return save / "checkpoint_last.pt"
