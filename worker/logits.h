/* logits.h - `meshrun logits WEIGHTS --text TEXT --out FILE [--config
 * config.json]`: runs the model's forward pass on the bytes of TEXT (one
 * sequence) and writes the logits, float32 little-endian [T, vocab], to
 * FILE.  WEIGHTS is a safetensors file written by meshrun (its config in
 * the metadata) or a Hugging Face model.safetensors with --config.  For
 * checking meshrun's numbers against another implementation. */
#ifndef MR_LOGITS_H
#define MR_LOGITS_H

/* argv[0] is "logits".  Returns the exit code (2: bad usage or input). */
int mr_logits_main(int argc, char **argv);

#endif
