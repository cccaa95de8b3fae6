/* What every vector kernel here includes. Each file of this directory is compiled alone into one object
   (compile/kernels/objects.py): with the instruction sets it needs (-m), and its variant and constants as
   macros (-D) that the file checks for with #error. */
#ifndef BERT_KERNELS_H
#define BERT_KERNELS_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#endif
