"""The pdstack Pulumi program: one ComponentResource per concern, driven by the typed stack model."""
