"""`deepspeed.ops`: the optimizers DeepSpeed scripts construct (`deepspeed.ops.adam`)."""
