"""Fusion: arrays in, pointer tables and fusion buckets out.

``tables`` holds a call's two entry points; ``intake`` decides once what kind of arrays a
call holds and takes each as it is (buffer protocol, DLPack, CUDA array interface;
``dlpack`` declares DLPack's C structs), and the table builders ``host`` and ``device``
read their pointers into ``call.Inputs``. ``cache`` keeps one ``CachedPlan`` per
signature: ``plan`` lays the tensors out in fusion buckets and ``backend`` says where a
step's buffers live (host or a GPU) and which kernels run on them.
"""
