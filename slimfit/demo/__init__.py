"""`slimfit demo`: fine-tune a real pretrained model on real data, plainly and with slimfit."""
