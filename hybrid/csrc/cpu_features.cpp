#include "cpu_features.h"

#include <cpuid.h>
#include <cstdint>
#include <cstring>

namespace hybrid {
namespace {

struct Regs {
  uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Regs cpuid(uint32_t leaf, uint32_t subleaf) {
  Regs r;
  if (!__get_cpuid_count(leaf, subleaf, &r.eax, &r.ebx, &r.ecx, &r.edx)) r = Regs{};
  return r;
}

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

bool bit(uint32_t reg, int n) { return (reg >> n) & 1u; }

}  // namespace

static std::map<std::string, bool> read_features() {
  const Regs l1 = cpuid(1, 0);
  const Regs l7 = cpuid(7, 0);
  const Regs l7s1 = cpuid(7, 1);

  const bool osxsave = bit(l1.ecx, 27);
  const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_avx = (xcr0 & 0x6) == 0x6;                 // XMM + YMM state
  const bool os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;  // opmask + ZMM_Hi256 + Hi16_ZMM
  const bool os_amx = (xcr0 & 0x60000) == 0x60000;         // XTILECFG + XTILEDATA

  std::map<std::string, bool> f;
  f["sse4_2"] = bit(l1.ecx, 20);
  f["avx"] = os_avx && bit(l1.ecx, 28);
  f["fma"] = os_avx && bit(l1.ecx, 12);
  f["f16c"] = os_avx && bit(l1.ecx, 29);
  f["avx2"] = os_avx && bit(l7.ebx, 5);
  f["avx512f"] = os_avx512 && bit(l7.ebx, 16);
  f["avx512dq"] = os_avx512 && bit(l7.ebx, 17);
  f["avx512cd"] = os_avx512 && bit(l7.ebx, 28);
  f["avx512bw"] = os_avx512 && bit(l7.ebx, 30);
  f["avx512vl"] = os_avx512 && bit(l7.ebx, 31);
  f["avx512_vbmi"] = os_avx512 && bit(l7.ecx, 1);
  f["avx512_vnni"] = os_avx512 && bit(l7.ecx, 11);
  f["avx512_fp16"] = os_avx512 && bit(l7.edx, 23);
  f["avx512_bf16"] = os_avx512 && bit(l7s1.eax, 5);
  f["amx_bf16"] = os_amx && bit(l7.edx, 22);
  f["amx_tile"] = os_amx && bit(l7.edx, 24);
  f["amx_int8"] = os_amx && bit(l7.edx, 25);
  return f;
}

std::map<std::string, bool> cpu_features() {
  static const std::map<std::string, bool> f = read_features();  // cpuid traps to the hypervisor in VMs: once
  return f;
}

bool subnormal_inputs_at_full_speed() {
  const Regs v = cpuid(0, 0);
  char id[13] = {0};
  std::memcpy(id + 0, &v.ebx, 4);
  std::memcpy(id + 4, &v.edx, 4);
  std::memcpy(id + 8, &v.ecx, 4);
  return std::strcmp(id, "AuthenticAMD") == 0 || std::strcmp(id, "HygonGenuine") == 0;
}

std::string cpu_brand() {
  const Regs ext = cpuid(0x80000000u, 0);
  if (ext.eax < 0x80000004u) return "";
  char brand[49] = {0};
  for (uint32_t i = 0; i < 3; ++i) {
    const Regs r = cpuid(0x80000002u + i, 0);
    std::memcpy(brand + 16 * i + 0, &r.eax, 4);
    std::memcpy(brand + 16 * i + 4, &r.ebx, 4);
    std::memcpy(brand + 16 * i + 8, &r.ecx, 4);
    std::memcpy(brand + 16 * i + 12, &r.edx, 4);
  }
  std::string s(brand);
  const auto b = s.find_first_not_of(' ');
  const auto e = s.find_last_not_of(' ');
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

}  // namespace hybrid
