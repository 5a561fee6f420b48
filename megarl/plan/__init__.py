"""Pre-launch planning: parameter counts, memory per device, batch algebra and sync time (`megarl-plan`)."""
