/* The softmax's exp: its argument's floor, the constants of its range reduction and its degree-3
   polynomial's coefficients, passed with -D from compile/kernels/attention_bf16.py (EXP_*), which the int8
   plan's simulation evaluates too (compile/int8_simulation.py). */
#ifndef BERT_EXP_H
#define BERT_EXP_H

#if !defined(BERT_EXP_FLOOR) || !defined(BERT_EXP_LOG2E) || !defined(BERT_EXP_LN2) || !defined(BERT_EXP_P0) || \
    !defined(BERT_EXP_P1) || !defined(BERT_EXP_P2) || !defined(BERT_EXP_P3)
#error "the exp's constants BERT_EXP_* are passed with -D (compile/kernels/attention_bf16.py)"
#endif

#endif
