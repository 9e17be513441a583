"""KV-block shipping between prefill (sender) and decode (receiver) workers.

Decode side::

    receiver = KVReceiver(cache, config); address = await receiver.start()
    rx = receiver.expect(request_id, dst_block_ids)      # before telling the sender the ids
    result = await rx.wait()                             # TransferResult | raises TransferError

Prefill side::

    sender = KVSender(cache, config)
    tx = await sender.begin(request_id, address)
    await tx.send_blocks(src_block_ids, dst_block_ids)   # once per finished prefill chunk
    await tx.finish({"note": "any small JSON"})           # waits for the receiver's ack (lease)
"""
import importlib

# Imported on first use (PEP 562): configuration readers (the worker's flags, pdctl) take
# ``kvtransfer.config`` without loading torch through the sender and receiver.
_EXPORTS = {
    "KVTransferConfig": "kvtransfer.config",
    **{name: "kvtransfer.errors" for name in (
        "ChecksumMismatch", "ConnectionLost", "HandshakeError", "PeerLost", "ProtocolError", "TransferAborted",
        "TransferError", "TransferTimeout")},
    "IncomingTransfer": "kvtransfer.receiver", "KVReceiver": "kvtransfer.receiver",
    "TransferResult": "kvtransfer.receiver",
    "KVSender": "kvtransfer.sender", "OutgoingTransfer": "kvtransfer.sender",
    "make_transport": "kvtransfer.transports",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
