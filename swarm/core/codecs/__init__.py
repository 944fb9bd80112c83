"""The codecs a pseudo-gradient's slices go over the wire in, and the error feedback that keeps what they drop."""
