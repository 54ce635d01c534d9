"""benchmarks/cost_calibration.py: measured against predicted cost per token count, and the
predictions by chosen length; the options and command line the chat benchmark scripts share."""

from vllm_specdiff_benchmarks.cost_calibration import calibration, predictions_by_choice


def test_calibration_pairs_each_count_with_its_predictions():
    steps = [(5, 0.030, 0.030, True), (5, 0.032, 0.030, True), (2, 0.040, 0.032, False)]
    table = calibration(steps)
    assert list(table) == [2, 5]
    assert table[5] == {"steps": 2, "measured_mean_ms": 31.0, "measured_median_ms": 31.0,
                        "predicted_mean_ms": 30.0, "measured_over_predicted": 1.033,
                        "own_point_share": 1.0}
    assert table[2]["measured_over_predicted"] == 1.25 and table[2]["own_point_share"] == 0.0


def test_predictions_are_averaged_per_chosen_length():
    choices = [(3, {4: 0.030, 5: 0.034}), (3, {4: 0.032, 5: 0.036}), (4, {4: 0.031, 5: 0.030})]
    assert predictions_by_choice(choices) == {
        3: {"plans": 2, "predicted_ms": {4: 31.0, 5: 35.0}},
        4: {"plans": 1, "predicted_ms": {4: 31.0, 5: 30.0}}}


def test_chat_scripts_share_their_options_and_record_their_command():
    from vllm_specdiff_benchmarks import chat_parser, invocation

    args = chat_parser("Title.\n\nBody.", prompts=16, max_tokens=96).parse_args(["--prompts", "4"])
    assert (args.prompts, args.max_tokens, args.out) == (4, 96, None)
    assert invocation("vllm_specdiff_benchmarks.cost_calibration", ["--prompts", "4"]) == [
        "python", "-m", "vllm_specdiff_benchmarks.cost_calibration", "--prompts", "4"]
