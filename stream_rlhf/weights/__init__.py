"""Versioned weight sync from trainers to the stages that serve or forward the same model.

    transport.py   the protocol every transport keeps (WeightSender: publish / close; WeightReceiver:
                   receive / close) and the one table TRANSPORTS {shm, broadcast, cuda_ipc} that opens
                   a sender and joins a receiver for `weights.transport`
    shm_store.py   WeightStore: a safetensors file per version in /dev/shm (publish / load_into / refresh);
                   ShmSender / ShmReceiver: the `shm` transport over it
    buckets.py     named tensors <-> a few uint8 buckets (BucketLayout, pack, unpack): what moves
    group.py       a process group of its own beside the default one (open_group, rendezvous, addresses)
    sender.py      the trainer side both senders share (SnapshotSender over SnapshotSlot, ServingThreads)
    broadcast.py   BroadcastSender / BroadcastReceiver: gloo or NCCL broadcast, asked for by each receiver
    cuda_ipc.py    CudaIpcSender / CudaIpcReceiver: CUDA IPC handles for a rollout on the trainer's GPU
"""
