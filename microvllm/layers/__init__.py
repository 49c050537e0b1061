"""Building blocks of a decoder layer: RMSNorm, rotary embedding, SiLU-gated MLP, attention."""
