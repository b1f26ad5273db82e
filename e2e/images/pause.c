/* The test node's Pod sandbox process: holds the Pod's namespaces open until it is told to stop,
 * and reaps any child that ends up with it as parent (it is PID 1 of the Pod).
 * Built statically by e2e/images/build; the image holds this one file. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void) {
    sigset_t wanted;
    sigemptyset(&wanted);
    sigaddset(&wanted, SIGTERM);
    sigaddset(&wanted, SIGINT);
    sigaddset(&wanted, SIGCHLD);
    /* Blocked, then taken synchronously: no handler can race the loop. */
    if (sigprocmask(SIG_BLOCK, &wanted, NULL) != 0) return 1;
    for (;;) {
        int signal_number = 0;
        if (sigwait(&wanted, &signal_number) != 0) return 1;
        if (signal_number == SIGCHLD) {
            while (waitpid(-1, NULL, WNOHANG) > 0) {
            }
            continue;
        }
        return 0;
    }
}
