"""Recipes: how a drafter is made, as one validated TOML file (`specdiff-distill recipe`).

fields.py types the tables, schema.py declares and validates the recipe, workspace.py places
its work, stages.py runs each stage through the existing steps, run.py orders and resumes them,
smoke.py scales a recipe down, new.py writes one for another verifier, cli.py is the subcommand.
"""
