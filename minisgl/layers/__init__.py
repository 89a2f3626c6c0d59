"""Model building blocks: tensor-parallel linear and embedding, norm, rotary, attention, sampling."""
