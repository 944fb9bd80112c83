"""Bytes between peers: the transport, the bulk channel and its sender, slices on the wire, state transfer."""
