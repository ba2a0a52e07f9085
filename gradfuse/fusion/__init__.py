"""Fusion: arrays in, pointer tables and fusion buckets out.

``intake`` reads arrays of any kind (buffer protocol, DLPack, CUDA array interface),
``tables`` turns a call's arrays into pointer tables and checks its outputs, ``plan``
lays tensors out in fusion buckets, and ``backend`` says where a step's buffers live
(host or a GPU) and which kernels run on them.
"""
