"""torch_ext's Dynamo VariableTrackers for HOPs traced with wrap semantics.

Importing this package changes nothing in Dynamo; `torch_ext.install()` registers `HOP_VARIABLES`.
"""
from .checkpoint import CheckpointVariable
from .invoke_subgraph import InvokeSubgraphVariable
from .local_map import LocalMapVariable
from .wrap import BaseHOPVariable, DynamoBypassingWrapperVariable, WrapVariable

# HOP __name__ -> our VariableTracker, the keys of Dynamo's own table that we replace.
HOP_VARIABLES = {
    "wrap": WrapVariable,
    "tag_activation_checkpoint": CheckpointVariable,
    "wrap_activation_checkpoint": CheckpointVariable,
    "invoke_subgraph": InvokeSubgraphVariable,
    "dynamo_bypassing_wrapper": DynamoBypassingWrapperVariable,
    "local_map_hop": LocalMapVariable,
}

# Dynamo's fallback for BaseHOPs that have no entry in the table.
BASE_HOP_VARIABLE = BaseHOPVariable

__all__ = [
    "HOP_VARIABLES",
    "BASE_HOP_VARIABLE",
    "CheckpointVariable",
    "InvokeSubgraphVariable",
    "WrapVariable",
    "DynamoBypassingWrapperVariable",
    "BaseHOPVariable",
    "LocalMapVariable",
]
