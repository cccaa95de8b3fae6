/* Preloaded by `python -m loadtest.cpuid_level`: every `cpuid` the process runs answers without the
 * leaf-7 feature bits HIDE_7_<subleaf>_<register> (defined at compile time: the features the level
 * lacks), so that the runtimes in it pick the kernels they pick on a CPU of that level. The kernel
 * makes `cpuid` fault (arch_prctl ARCH_SET_CPUID, kept across fork and clone); the fault handler
 * runs the real instruction and clears those bits. Only what software reads through `cpuid`
 * changes: /proc/cpuinfo and the hardware do not.
 * Runtimes install SIGSEGV handlers of their own (TVM's prints a backtrace): `signal` and `sigaction`
 * are wrapped so that ours stays installed and theirs gets every fault that is not a `cpuid`. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static volatile unsigned long answered;
static struct sigaction program_handler;  /* the SIGSEGV handler the program asked for (default at first) */
static int installed;

static int real_sigaction(int signal_number, const struct sigaction *action, struct sigaction *old) {
    static int (*next)(int, const struct sigaction *, struct sigaction *);
    if (!next) next = (int (*)(int, const struct sigaction *, struct sigaction *))dlsym(RTLD_NEXT, "sigaction");
    return next(signal_number, action, old);
}

int sigaction(int signal_number, const struct sigaction *action, struct sigaction *old) {
    if (signal_number != SIGSEGV || !installed) return real_sigaction(signal_number, action, old);
    if (old) *old = program_handler;
    if (action) program_handler = *action;
    return 0;
}

sighandler_t signal(int signal_number, sighandler_t handler) {
    static sighandler_t (*next)(int, sighandler_t);
    if (signal_number != SIGSEGV || !installed) {
        if (!next) next = (sighandler_t (*)(int, sighandler_t))dlsym(RTLD_NEXT, "signal");
        return next(signal_number, handler);
    }
    sighandler_t previous = program_handler.sa_handler;
    memset(&program_handler, 0, sizeof program_handler);
    program_handler.sa_handler = handler;
    return previous;
}

/* A fault that is not a `cpuid`: the program's handler has it, or the default action on the retry. */
static void pass_on(int signal_number, siginfo_t *info, void *context) {
    if (program_handler.sa_flags & SA_SIGINFO) {
        program_handler.sa_sigaction(signal_number, info, context);
    } else if (program_handler.sa_handler != SIG_DFL && program_handler.sa_handler != SIG_IGN) {
        program_handler.sa_handler(signal_number);
    } else {
        struct sigaction fallback;
        memset(&fallback, 0, sizeof fallback);
        fallback.sa_handler = SIG_DFL;
        real_sigaction(SIGSEGV, &fallback, NULL);
    }
}

/* How many `cpuid` the handler has answered: a benchmark checks that none come while it times. */
unsigned long cpuid_level_answered(void) { return answered; }

static const uint32_t hidden[2][4] = {
    {HIDE_7_0_EAX, HIDE_7_0_EBX, HIDE_7_0_ECX, HIDE_7_0_EDX},
    {HIDE_7_1_EAX, HIDE_7_1_EBX, HIDE_7_1_ECX, HIDE_7_1_EDX},
};

static void answer_cpuid(int signal_number, siginfo_t *info, void *context) {
    greg_t *registers = ((ucontext_t *)context)->uc_mcontext.gregs;
    const uint8_t *instruction = (const uint8_t *)registers[REG_RIP];
    if (instruction[0] != 0x0f || instruction[1] != 0xa2) {
        pass_on(signal_number, info, context);
        return;
    }
    uint32_t leaf = (uint32_t)registers[REG_RAX], subleaf = (uint32_t)registers[REG_RCX], r[4];
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(subleaf));
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    if (leaf == 7 && subleaf <= 1) {
        for (int i = 0; i < 4; i++) r[i] &= ~hidden[subleaf][i];
    }
    registers[REG_RAX] = r[0], registers[REG_RBX] = r[1], registers[REG_RCX] = r[2], registers[REG_RDX] = r[3];
    registers[REG_RIP] += 2;
    answered++;
}

__attribute__((constructor)) static void hold_cpuid(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = answer_cpuid;
    action.sa_flags = SA_SIGINFO;
    real_sigaction(SIGSEGV, &action, &program_handler);
    installed = 1;
    if (syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) != 0) {  /* never run unheld and look held */
        static const char message[] = "cpuid_level: this kernel cannot make cpuid fault (arch_prctl ARCH_SET_CPUID)\n";
        (void)!write(2, message, sizeof message - 1);
        _exit(2);
    }
}
