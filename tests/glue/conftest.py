import pytest

from .helpers import binarise_toy_corpus, binarise_toy_lm_corpus


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    return binarise_toy_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def lm_data_bin(tmp_path_factory):
    return binarise_toy_lm_corpus(tmp_path_factory.mktemp("lm_corpus"))
