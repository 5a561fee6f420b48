"""Console entry points: megarl-train, megarl-preprocess, megarl-convert."""
