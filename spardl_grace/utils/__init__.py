"""Helpers shared by the compressors, communicators and codecs: generators that every rank
seeds alike (seeding), and fixed- and variable-width bit packing (bitpack)."""
