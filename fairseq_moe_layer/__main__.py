"""python -m fairseq_moe_layer: the table of the layer's flags, made from its settings (docs/flags.md holds it;
tests/fairseq_moe_layer/test_config.py checks that the two agree)."""
from .config import MoEConfig
from .options import flag_table

print(flag_table(MoEConfig), end="")
