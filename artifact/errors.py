"""The one error of the artifact's runtime half."""


class ArtifactError(Exception):
    """An artifact directory that cannot be loaded (missing, corrupt, wrong schema, foreign CPU)."""
