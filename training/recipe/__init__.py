"""Recipes: how a drafter is made, as one validated TOML file (`specdiff-distill recipe`).

fields.py types the tables, schema.py declares and validates the recipe (data_schema.py its
[generate] and [data] tables), workspace.py places its work, packs.py makes and unpacks its data,
stages.py runs the other stages through the existing steps, run.py orders and resumes them,
smoke.py scales a recipe down, new.py writes one for another verifier, cli.py is the subcommand.
"""
