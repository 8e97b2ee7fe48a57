"""Recipes: YAML -> typed, validated :class:`RecipeConfig` (no torch imported here)."""

from relax_hpc.config.load import apply_overrides, load_recipe, parse_override, validate_dict, validate_resolved
from relax_hpc.config.schema import RecipeConfig

__all__ = ["RecipeConfig", "apply_overrides", "load_recipe", "parse_override", "validate_dict", "validate_resolved"]
