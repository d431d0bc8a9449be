/* Loaded into tritonserver (LD_PRELOAD) by tasks/serving/server.py: the Triton control key leaves its command line.

   Triton 2.51 takes the key of its restricted APIs on the command line only
   (--http-restricted-api=...:llmops-control-key=KEY and --grpc-restricted-protocol=...), where every local user
   reads it in /proc/PID/cmdline for the life of the process. Its parser (src/command_line_parser.cc,
   TritonParser::Parse) walks argv in one getopt_long loop and copies each value into its own strings
   (ParseRestrictedFeatureOption); once getopt_long answers -1 nothing reads argv again. This wraps glibc's
   getopt_long: at that -1, in a process named tritonserver only (setpriv, which starts it, parses its own argv with
   getopt_long too and must pass the key on), each key in argv is overwritten in place, which is what
   /proc/PID/cmdline shows from then on. The key is still there for the milliseconds between exec and the parse. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <string.h>

static const char MARK[] = "llmops-control-key=";

typedef int (*getopt_long_fn)(int, char *const[], const char *, const struct option *, int *);

int getopt_long(int argc, char *const argv[], const char *optstring, const struct option *longopts, int *longindex) {
    static getopt_long_fn real;
    if (real == NULL) real = (getopt_long_fn)dlsym(RTLD_NEXT, "getopt_long");
    int flag = real(argc, argv, optstring, longopts, longindex);
    if (flag == -1 && strcmp(program_invocation_short_name, "tritonserver") == 0) {
        for (int i = 0; i < argc; i++) {
            char *key = strstr(argv[i], MARK);
            if (key != NULL) {
                key += sizeof(MARK) - 1;
                memset(key, '*', strlen(key));
            }
        }
    }
    return flag;
}
