"""Plans: a configuration's memory and step time, from one step traced on fake tensors."""
