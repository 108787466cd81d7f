"""DeepReduce-style codecs for sparse payloads (Kostopoulou, Xu et al., arXiv 2102.03112).

Index codecs: none, delta, rle, huffman, bloom (policies p0, leftmost, random, conflict_sets).
Value codecs: none, fp16, deflate, qsgd, polyfit, dexp.

    # GRACE communicators (allgather, broadcast): wrap the sparsifier, as in DeepReduce's README
    grc = grace_from_params(params)
    grc.compressor = DeepReduce(grc.compressor, params)   # or deepreduce_from_params(params)
    # sparse all-reduces: the same keys install the codec on every message (importing this
    # package registers them with spardl_grace.registry)
    grc = grace_from_params({'compressor': 'topk', 'memory': 'global_residual',
                             'communicator': 'spardl', 'deepreduce': 'both',
                             'index': 'bloom', 'value': 'polyfit'})
"""

from .codec import DEFAULTS, INDEX_CODECS, VALUE_CODECS, DeepReduceCodec, codec_from_params
from .compressors import DeepReduce, IndexCompressor, ValueCompressor, deepreduce_from_params

__all__ = [
    "DEFAULTS",
    "INDEX_CODECS",
    "VALUE_CODECS",
    "DeepReduce",
    "DeepReduceCodec",
    "IndexCompressor",
    "ValueCompressor",
    "codec_from_params",
    "deepreduce_from_params",
]
