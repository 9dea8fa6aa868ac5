/* A second-level guest that uses the passed-through edu: DMA through L2 → L1's vfio-pci → QEMU's emulated VT-d →
 * edu, then answers an ACPI hot-unplug request (what a guest OS's _EJ0 does) so the device really leaves.
 *
 * Bare metal on purpose: under TCG inside TCG a Linux boot costs ~400 s, this costs seconds. Multiboot v1 ELF for
 * QEMU's `-machine pc -kernel` (SeaBIOS has assigned BAR0); 32-bit protected mode, no paging, so guest-physical
 * addresses are the DMA addresses. Results are lines on COM1; `L2 DONE` ends a run.
 */
#include <stdint.h>

#define EDU_ID 0x11e81234u
#define EDU_DMA_DEV 0x40000u /* the device's own buffer */
#define DMA_LEN 2048u /* < the 4 KiB buffer: QEMU 7.2 edu rejects a transfer that ends at its last byte */
#define SRC ((volatile uint8_t *)0x200000)
#define DST ((volatile uint8_t *)0x300000)
#define PIIX_PCIHP 0xae00 /* ACPI PCI hotplug registers: +4 pending removals (slot bits), +8 eject */

__attribute__((section(".multiboot"), used)) static const uint32_t mb_header[3] = {
    0x1BADB002u, 0u, (uint32_t)-(0x1BADB002u + 0u)};

static inline void outb(uint16_t p, uint8_t v) { __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(p)); }
static inline uint8_t inb(uint16_t p) {
    uint8_t v;
    __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(p));
    return v;
}
static inline void outl(uint16_t p, uint32_t v) { __asm__ volatile("outl %0, %1" : : "a"(v), "Nd"(p)); }
static inline uint32_t inl(uint16_t p) {
    uint32_t v;
    __asm__ volatile("inl %1, %0" : "=a"(v) : "Nd"(p));
    return v;
}
static void putc(char c) {
    while (!(inb(0x3fd) & 0x20)) {
    }
    outb(0x3f8, (uint8_t)c);
}
static void puts(const char *s) {
    while (*s) putc(*s++);
}
static void puthex(uint32_t v) {
    for (int i = 28; i >= 0; i -= 4) putc("0123456789abcdef"[(v >> i) & 15]);
}
static uint32_t cfg_addr(int dev, int off) { return 0x80000000u | ((uint32_t)dev << 11) | ((uint32_t)off & 0xfc); }
static uint32_t cfg_read(int dev, int off) {
    outl(0xcf8, cfg_addr(dev, off));
    return inl(0xcfc);
}
static void cfg_write(int dev, int off, uint32_t v) {
    outl(0xcf8, cfg_addr(dev, off));
    outl(0xcfc, v);
}
#define REG(off) (*(volatile uint32_t *)(bar0 + (off)))

static int dma(uint32_t bar0, uint32_t src, uint32_t dst, uint32_t cmd) {
    REG(0x80) = src;
    REG(0x84) = 0;
    REG(0x88) = dst;
    REG(0x8c) = 0;
    REG(0x90) = DMA_LEN;
    REG(0x94) = 0;
    REG(0x98) = cmd | 1u;
    for (uint32_t spins = 0; spins < 0x40000000u; spins++)
        if (!(REG(0x98) & 1u)) return 0;
    return -1;
}

static void halt(void) {
    for (;;) __asm__ volatile("hlt");
}

void l2_main(void) {
    int slot = -1;
    puts("L2 UP\n");
    for (int dev = 0; dev < 32; dev++)
        if (cfg_read(dev, 0) == EDU_ID) slot = dev;
    if (slot < 0) {
        puts("L2 NO-EDU\nL2 DONE\n");
        halt();
    }
    uint32_t bar0 = cfg_read(slot, 0x10) & ~0xfu;
    cfg_write(slot, 0x04, cfg_read(slot, 0x04) | 0x6u); /* memory space + bus master */
    REG(0x04) = 0x12345678u;
    puts(REG(0x04) == ~0x12345678u ? "L2 LIVE OK\n" : "L2 LIVE BAD\n");
    for (uint32_t i = 0; i < DMA_LEN; i++) {
        SRC[i] = (uint8_t)(i * 7u + 3u);
        DST[i] = 0;
    }
    if (dma(bar0, 0x200000u, EDU_DMA_DEV, 0) || dma(bar0, EDU_DMA_DEV, 0x300000u, 2u)) {
        puts("L2 DMA TIMEOUT\nL2 DONE\n");
        halt();
    }
    uint32_t bad = 0;
    for (uint32_t i = 0; i < DMA_LEN; i++)
        if (DST[i] != (uint8_t)(i * 7u + 3u)) bad++;
    puts(bad ? "L2 DMA BAD " : "L2 DMA OK ");
    puthex(bad);
    puts(" bar0=");
    puthex(bar0);
    puts("\nL2 WAITING-UNPLUG\n");
    while (!(inl(PIIX_PCIHP + 4) & (1u << slot))) {
    }
    outl(PIIX_PCIHP + 8, 1u << slot);
    puts("L2 EJECTED\nL2 DONE\n");
    halt();
}

__asm__(".text\n.globl _start\n_start:\n  mov $0x180000, %esp\n  call l2_main\n1: hlt\n  jmp 1b\n");
