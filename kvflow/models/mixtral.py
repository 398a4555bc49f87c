"""Mixtral: the Llama decoder with a mixture of experts in place of each MLP (models/moe.py; the layers
choose it from the config's expert count). Only its checkpoint names differ."""

from kvflow.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    renamed_params = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                      (".w2.", ".down_proj."))
