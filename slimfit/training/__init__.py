"""The training loop shared by `slimfit demo` and the accuracy benchmarks (bench/accuracy.py,
bench/decoder_accuracy.py, bench/_vision_finetune.py, ...): one seeded fine-tuning run of any method, given
as `prepare(model) -> Prepared`, with its measurements (accuracy, saved bytes, step peak, step time).

    finetune.py   Prepared / RunResult, prepare_preset (a SlimFitConfig preset plus an ILSScheduler),
                  train_and_evaluate (the loop), finetune (a sequence classifier from a local model folder),
                  evaluate, count_labels, quiet_transformers
"""
